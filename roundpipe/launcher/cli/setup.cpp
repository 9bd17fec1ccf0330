#include "roundpipe/launcher/cli/setup.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <sstream>

#include "base/logging.h"
#include "roundpipe/devices.h"
#include "roundpipe/launcher/atomic_file.h"
#include "roundpipe/models/layers.h"
#include "roundpipe/side_inputs.h"

namespace roundpipe::launcher {

// Note [Deterministic plans]:
// RoundPipe normally times every layer in the first call and re-partitions from the measured
// times, so the stages of later calls depend on the machine's timing noise. The launcher keeps the
// size-based plan instead (measure_layer_times = false): a run and its resumed continuation then
// execute identical plans, one of the conditions of bitwise-equal resumes (docs/launcher.md).

// Note [LoRA in the launcher]:
// With model.lora the pretrained base is loaded in model.dtype, apply_lora (models/lora.h) adds
// PEFT-initialised adapters (seeded by train.seed, so a run is reproducible) or
// load_lora_adapter reads model.lora.adapter, and every base weight is frozen (requires_grad
// false). RoundPipe keeps no master copy, gradient or optimizer state for frozen parameters, so
// the optimizer only sees the adapters. Checkpoints hold the adapters as a PEFT directory
// (adapter_config.json + adapter_model.safetensors, fp32 masters) instead of the whole model; the
// frozen base is re-read from model.pretrained on resume, which is why a resumed run is bitwise
// equal to a straight one as long as that directory does not change.

void check_supported(const LauncherConfig& config, const models::ModelConfig& model_config) {
  if (config.data.format == DataFormat::kChat && model_config.is_moe()) {
    // The router's load-balancing loss is weighted by every position of a microbatch, padding
    // included, while chat losses are normalized by trained labels: the mix would not be
    // transformers' (which masks padding out of the router statistics).
    throw ConfigError("data.format: chat with a mixture-of-experts model (" +
                      std::string(models::model_type_name(model_config.architecture)) +
                      ") is not supported yet: the router's load-balancing loss would count padding; "
                      "train it on token data (data.format: tokens) for now");
  }
  std::optional<int64_t> data_vocab = data_vocab_size(config);
  if (data_vocab.has_value() && *data_vocab > model_config.vocab_size) {
    throw ConfigError("data.format: " + std::string(data_format_name(config.data.format)) +
                      " data has token ids up to " + std::to_string(*data_vocab - 1) +
                      " but the model's vocab_size is " + std::to_string(model_config.vocab_size) +
                      "; set model.config.vocab_size >= " + std::to_string(*data_vocab));
  }
}

models::ModelConfig resolve_model_config(const LauncherConfig& config) {
  nlohmann::json json = nlohmann::json::parse(resolved_model_config_json(config));
  if (config.model.preset && !json.contains("model_type")) {
    json["model_type"] = models::model_type_name(*config.model.preset);
  }
  try {
    return models::parse_model_config(json.dump(), config.model.pretrained.empty()
                                                       ? std::string("model.config")
                                                       : config.model.pretrained + "/config.json");
  } catch (const c10::Error& e) {
    throw ConfigError("model.config: " + std::string(e.what_without_backtrace()));
  }
}

std::optional<models::LoraOptions> lora_options(const LauncherConfig& config) {
  if (!config.model.lora.has_value()) return std::nullopt;
  const LoraSection& lora = *config.model.lora;
  std::vector<std::string> targets;
  for (const std::string& target : lora.targets) {
    if (target == "all-linear") {
      // PEFT's all-linear: every Linear but the output layer.
      targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
      break;
    }
    if (std::find(targets.begin(), targets.end(), target) == targets.end()) targets.push_back(target);
  }
  return models::LoraOptions()
      .rank(lora.rank)
      .alpha(lora.alpha)
      .dropout(lora.dropout)
      .target_modules(targets)
      .target_parameters(lora.target_parameters);
}

namespace {

models::Pretrained make_base_model(const LauncherConfig& config, const models::ModelConfig& model_config) {
  const c10::ScalarType dtype = config.model.dtype;
  if (!config.model.pretrained.empty()) {
    return models::load_pretrained(config.model.pretrained, models::LoadOptions().dtype(dtype));
  }
  at::manual_seed(config.train.seed);
  models::Pretrained pre = models::build(model_config);
  pre.model->to(dtype);
  return pre;
}

std::string join_names(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ",") + n;
  return "[" + out + "]";
}

// The adapter's options replace model.lora's keys; say so when they differ.
void warn_replaced_options(const models::LoraOptions& wanted, const models::LoraOptions& applied,
                           const std::string& adapter) {
  std::string changes;
  auto note = [&](const std::string& key, const std::string& ours, const std::string& theirs) {
    if (ours != theirs) changes += " " + key + " " + ours + " -> " + theirs + ";";
  };
  auto text = [](double v) {
    std::ostringstream out;
    out << v;
    return out.str();
  };
  note("rank", std::to_string(wanted.rank()), std::to_string(applied.rank()));
  note("alpha", text(wanted.alpha()), text(applied.alpha()));
  note("dropout", text(wanted.dropout()), text(applied.dropout()));
  note("targets", join_names(wanted.target_modules()), join_names(applied.target_modules()));
  note("target_parameters", join_names(wanted.target_parameters()), join_names(applied.target_parameters()));
  if (!changes.empty()) {
    ROUNDPIPE_LOG(Logger::get("launcher"), kWarn, "model.lora: the adapter ", adapter,
                  " replaces model.lora's keys:", changes);
  }
}

}  // namespace

void check_lora_targets(const LauncherConfig& config, const models::ModelConfig& model_config) {
  if (model_config.is_moe() && config.model.lora.has_value()) {
    const auto& targets = config.model.lora->targets;
    if (std::find(targets.begin(), targets.end(), "all-linear") != targets.end()) {
      // PEFT's all-linear on these models also adapts every router and the fused experts
      // (target_parameters); adapting less would silently differ from PEFT.
      throw ConfigError("model.lora.targets: all-linear on a mixture-of-experts model (" +
                        std::string(models::model_type_name(model_config.architecture)) +
                        ") means, in PEFT, the attention projections plus every router and the fused experts, "
                        "and RoundPipe never adapts the router; list the modules instead, e.g. "
                        "targets: [q_proj, k_proj, v_proj, o_proj] with target_parameters: [gate_up_proj, down_proj]");
    }
  }
  if (!model_config.is_moe() && config.model.lora.has_value() && !config.model.lora->target_parameters.empty()) {
    throw ConfigError("model.lora.target_parameters: " + join_names(config.model.lora->target_parameters) +
                      " adapt mixture-of-experts weights, and " +
                      std::string(models::model_type_name(model_config.architecture)) +
                      " has no experts; remove the key (model.lora.targets adapts its Linear layers)");
  }
  if (config.model.lora.has_value() && !config.model.lora->target_parameters.empty() &&
      config.model.lora->dropout != 0) {
    throw ConfigError("model.lora.dropout: " + std::to_string(config.model.lora->dropout) +
                      " with model.lora.target_parameters; as in PEFT, adapters on expert weights need dropout 0");
  }
}

LauncherModel make_launcher_model(const LauncherConfig& config) {
  models::ModelConfig model_config = resolve_model_config(config);
  check_supported(config, model_config);
  check_lora_targets(config, model_config);
  models::Pretrained pre = make_base_model(config, model_config);
  auto head = pre.model->ptr<models::LmHeadImpl>(pre.model->size() - 1);
  head->set_loss_chunk_bytes(config.run.loss_chunk_mib << 20);
  head->set_report_correct(true);  // evaluate() reports token accuracy; training is unchanged
  if (model_config.is_moe()) {
    // model.config may override the checkpoint's coefficient.
    pre.config.router_aux_loss_coef = model_config.router_aux_loss_coef;
    head->set_router_aux_loss_coef(model_config.router_aux_loss_coef);
  }
  LauncherModel out{pre.model, pre.config, lora_options(config)};
  if (!out.lora.has_value()) return out;
  // Note [LoRA in the launcher]
  if (!config.model.lora->adapter.empty()) {
    models::LoraOptions applied = models::load_lora_adapter(out.model, out.config, config.model.lora->adapter);
    warn_replaced_options(*out.lora, applied, config.model.lora->adapter);
    out.lora = applied;
  } else {
    at::manual_seed(config.train.seed);
    models::apply_lora(out.model, *out.lora);
  }
  return out;
}

ParameterCounts count_parameters(const torch::nn::Module& model) {
  ParameterCounts counts;
  for (const at::Tensor& p : models::unique_parameters(model)) {
    counts.total += p.numel();
    if (p.requires_grad()) counts.trainable += p.numel();
  }
  return counts;
}

std::string describe_parameter_counts(const ParameterCounts& counts) {
  auto grouped = [](int64_t n) {
    std::string digits = std::to_string(n), out;
    for (size_t i = 0; i < digits.size(); ++i) {
      if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
      out += digits[i];
    }
    return out;
  };
  char percent[32];
  std::snprintf(
      percent, sizeof(percent), "%.4f",
      counts.total > 0 ? 100.0 * static_cast<double>(counts.trainable) / static_cast<double>(counts.total) : 0.0);
  return "trainable parameters: " + grouped(counts.trainable) + " of " + grouped(counts.total) + " (" + percent + "%)";
}

std::string lora_base_model_path(const LauncherConfig& config) {
  char resolved[PATH_MAX];
  if (::realpath(config.model.pretrained.c_str(), resolved) != nullptr) return resolved;
  return config.model.pretrained;
}

namespace {

// Note [GPUs of local ranks]: one RoundPipe process normally uses every GPU of its node. When a
// launch starts several ranks per node and run.devices is auto, local rank r takes the GPUs whose
// index is r modulo LOCAL_WORLD_SIZE; with fewer GPUs than local ranks, ranks share GPU
// r % count. CPU-only: each rank gets its own CPU worker.
std::vector<c10::Device> devices_of_rank(const LauncherConfig& config) {
  if (config.run.devices.has_value()) return *config.run.devices;
  std::vector<c10::Device> all = default_devices();
  const comm::LaunchEnv env = comm::LaunchEnv::from_env();
  if (env.local_world_size <= 1 || all.empty() || !all.front().is_cuda()) return all;
  const auto count = static_cast<int64_t>(all.size());
  if (count < env.local_world_size) return {all[static_cast<size_t>(env.local_rank % count)]};
  std::vector<c10::Device> mine;
  for (int64_t k = 0; k < count; ++k) {
    if (k % env.local_world_size == env.local_rank) mine.push_back(all[static_cast<size_t>(k)]);
  }
  return mine;
}

}  // namespace

std::shared_ptr<comm::ProcessGroup> make_process_group(const LauncherConfig& config) {
  const comm::LaunchEnv env = comm::LaunchEnv::from_env();
  if (env.world_size <= 1) return nullptr;
  const std::vector<c10::Device> devices = devices_of_rank(config);
  const auto cuda = std::find_if(devices.begin(), devices.end(), [](const c10::Device& d) { return d.is_cuda(); });
  comm::ProcessGroupOptions options;
  options.timeout(std::chrono::milliseconds(static_cast<int64_t>(config.distributed.timeout_s * 1000.0)));
  if (config.distributed.backend == DistributedBackend::kGloo) {
    options.backend(comm::Backend::kGloo);
  } else if (config.distributed.backend == DistributedBackend::kNccl) {
    if (cuda == devices.end()) {
      throw ConfigError(
          "distributed.backend: nccl needs CUDA devices, but this rank's run.devices are CPU; use "
          "distributed.backend=gloo (or auto)");
    }
    options.backend(comm::Backend::kNccl).device(*cuda);
  } else if (cuda != devices.end()) {
    options.device(*cuda);  // auto: nccl
  }
  return comm::ProcessGroup::create(env, options);
}

bool in_place_masters(const LauncherConfig& config) {
  return config.model.master_dtype == config.model.dtype && config.run.step_mode == StepMode::kSync;
}

// Note [Gradients in the compute dtype]:
// With bf16 (or fp16) compute copies and float32 masters, RoundPipe's step would cast each
// iteration's 16-bit gradients into a float32 buffer per master (4 B/param that live all run) for
// the step function. roundpipe::optim::Adam reads 16-bit gradients directly and widens them
// exactly in its fused pass, so the launcher hands them over as they are
// (RoundPipeOptions::master_grad_dtype). What else reads the master gradients must not round
// them: train.clip_grad_norm computes the norm in float32 and applies the coefficient inside the
// step (optim::clip_grad_norm), so the update is the one the float32 buffers gave (bitwise, as the
// norms of widened values are the same, except that gradients of more than 2^22 elements are
// normed in pieces: Note [Clip norms in pieces] in optim/adam.cpp); GradScaler would unscale in 16
// bits, so with amp.scaler the buffers stay, as they do for SGD, Lion and Adafactor.
std::optional<c10::ScalarType> master_grad_dtype(const LauncherConfig& config) {
  const c10::ScalarType compute = config.model.dtype;
  const bool sixteen_bit = compute == at::kBFloat16 || compute == at::kHalf;
  const bool adam = config.optimizer.name == OptimizerName::kAdam || config.optimizer.name == OptimizerName::kAdamW;
  // float32 masters of 16-bit compute copies are never the compute copies (in_place_masters).
  if (!sixteen_bit || !adam || config.amp.scaler || config.model.master_dtype != at::kFloat) return std::nullopt;
  return compute;
}

RoundPipeOptions round_pipe_options(const LauncherConfig& config, bool model_draws) {
  RunConfig run;
  run.num_microbatch = config.run.num_microbatch;
  run.recompute_grain = config.run.recompute;
  run.preserve_rng_state = model_draws;
  // Masters in the compute dtype with sync steps: the compute copies are the masters (no second
  // copy; RoundPipeOptions::in_place_masters). bf16 masters are only allowed this way (config rules).
  const bool in_place = in_place_masters(config);
  return RoundPipeOptions()
      .devices(devices_of_rank(config))
      .optim_dtype(in_place ? std::nullopt : std::optional<c10::ScalarType>(config.model.master_dtype))
      .in_place_masters(in_place)
      .sync_steps(config.run.step_mode == StepMode::kSync)  // CPU devices share the compute copies
      .master_grad_dtype(master_grad_dtype(config))
      .run_config(run)
      .seed(config.train.seed)
      .label_to_last_layer(true)    // the LmHead computes the loss, chunked (models::linear_cross_entropy)
      .measure_layer_times(false);  // Note [Deterministic plans]
}

std::string LauncherData::describe() const { return chat ? chat->describe() : tokens->describe(); }

std::unique_ptr<BatchSampler> LauncherData::sampler(int64_t rows, uint64_t seed) const {
  if (chat) return std::make_unique<ChatSampler>(*chat, rows, seed);
  return std::make_unique<TrainSampler>(*tokens, rows, seq_len, seed);
}

std::unique_ptr<BatchReader> LauncherData::eval_batches(int64_t rows, int64_t max_batches) const {
  if (chat) return std::make_unique<ChatEvalBatches>(*chat, rows, max_batches);
  return std::make_unique<EvalBatches>(*tokens, rows, seq_len, max_batches);
}

LauncherData open_data(const LauncherConfig& config, const std::string& path, uint64_t seed_offset) {
  LauncherData data;
  data.seq_len = config.data.seq_len;
  switch (config.data.format) {
    case DataFormat::kTokens:
      data.tokens = open_token_file(path);
      return data;
    case DataFormat::kBytes:
      data.tokens = open_byte_file(path);
      return data;
    case DataFormat::kChat: {
      const std::string& dir = config.model.pretrained;
      std::optional<models::Tokenizer> tokenizer;
      std::optional<models::ChatTemplate> chat_template;
      try {
        tokenizer = models::Tokenizer::from_file(join_path(dir, "tokenizer.json"));
        chat_template = models::ChatTemplate::from_model_dir(dir);
      } catch (const std::exception& e) {  // a file of the model directory; the message names it
        throw ConfigError(std::string("model.pretrained (chat data needs its tokenizer and chat template): ") +
                          e.what());
      }
      const int64_t model_vocab = resolve_model_config(config).vocab_size;
      if (tokenizer->vocab_size() > model_vocab) {
        throw ConfigError("model.pretrained: " + join_path(dir, "tokenizer.json") + " has " +
                          std::to_string(tokenizer->vocab_size()) + " token ids but the model's vocab_size is " +
                          std::to_string(model_vocab) +
                          ": the tokenizer does not belong to this model (or set "
                          "model.config.vocab_size >= " +
                          std::to_string(tokenizer->vocab_size()) + ")");
      }
      ChatDataOptions options;
      options.train_on = config.data.train_on;
      options.seq_len = config.data.seq_len;
      options.packing = config.data.packing;
      data.chat = std::make_unique<ChatDataset>(ChatDataset::load(path, *chat_template, *tokenizer, options));
      return data;
    }
    case DataFormat::kSynthetic:
      break;
  }
  const int64_t vocab = data_vocab_size(config).value_or(256);
  // Enough tokens for every training window to be fresh-looking; the stream is a pure function.
  data.tokens = make_synthetic_tokens(config.train.seed + seed_offset, vocab, int64_t{1} << 24);
  return data;
}

EvalResult evaluate(RoundPipe& model, const LauncherConfig& config, const LauncherData& data) {
  std::unique_ptr<BatchReader> batches = data.eval_batches(config.train.batch_size, config.eval.max_batches);
  at::NoGradGuard no_grad;
  model.module()->eval();
  double total = 0.0;
  double correct = 0.0;
  int64_t count = 0;
  while (std::optional<Batch> batch = batches->next()) {
    // The training runs' microbatch count (the engine's default unless set), at most one per row.
    RunConfig run;
    run.num_microbatch = std::min<int64_t>(
        batch->inputs.size(0),
        config.run.num_microbatch.value_or(default_num_microbatch(static_cast<int64_t>(model.devices().size()))));
    // The head given the labels returns each microbatch's {summed loss, correct predictions}
    // (LmHead::set_report_correct); no logits are made.
    SideInputScope side(batch->side_inputs);  // packed chat rows
    const at::Tensor sums = model.forward({batch->inputs}, batch->labels, run).to(at::kDouble).sum(0);
    total += sums[0].item<double>();
    correct += sums[1].item<double>();
    count += batch->labels.ne(kIgnoreLabel).sum().item<int64_t>();
  }
  model.module()->train();
  return {total / static_cast<double>(count), correct / static_cast<double>(count)};
}

}  // namespace roundpipe::launcher
