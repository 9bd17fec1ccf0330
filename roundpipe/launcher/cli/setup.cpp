#include "roundpipe/launcher/cli/setup.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>

#include <nlohmann/json.hpp>

#include "roundpipe/devices.h"

namespace roundpipe::launcher {

// Note [Deterministic plans]:
// RoundPipe normally times every layer in the first call and re-partitions from the measured
// times, so the stages of later calls depend on the machine's timing noise. The launcher keeps the
// size-based plan instead (measure_layer_times = false): a run and its resumed continuation then
// execute identical plans, one of the conditions of bitwise-equal resumes (docs/launcher.md).

void check_supported(const LauncherConfig& config, const models::ModelConfig& model_config) {
  if (config.model.lora.has_value()) {
    throw ConfigError("model.lora: LoRA is not available yet (issue 13); remove model.lora to "
                      "fine-tune every weight");
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
  if (!config.model.preset.empty() && !json.contains("model_type")) {
    json["model_type"] = config.model.preset;
  }
  try {
    return models::parse_model_config(json.dump(), config.model.pretrained.empty()
                                                        ? std::string("model.config")
                                                        : config.model.pretrained + "/config.json");
  } catch (const c10::Error& e) {
    throw ConfigError("model.config: " + std::string(e.what_without_backtrace()));
  }
}

models::Pretrained make_launcher_model(const LauncherConfig& config, bool allocate_only) {
  models::ModelConfig model_config = resolve_model_config(config);
  check_supported(config, model_config);
  const c10::ScalarType dtype = config.model.dtype;
  if (allocate_only) {
    return {models::make_model(model_config, at::TensorOptions().dtype(dtype)), model_config};
  }
  if (!config.model.pretrained.empty()) {
    return models::load_pretrained(config.model.pretrained, models::LoadOptions().dtype(dtype));
  }
  at::manual_seed(config.train.seed);
  models::Pretrained pre = models::build(model_config);
  pre.model->to(dtype);
  return pre;
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
  if (config.distributed.backend == "gloo") {
    options.backend("gloo");
  } else if (config.distributed.backend == "nccl") {
    if (cuda == devices.end()) {
      throw ConfigError("distributed.backend: nccl needs CUDA devices, but this rank's run.devices are CPU; use "
                        "distributed.backend=gloo (or auto)");
    }
    options.backend("nccl").device(*cuda);
  } else if (cuda != devices.end()) {
    options.device(*cuda);  // auto: nccl
  }
  return comm::ProcessGroup::create(env, options);
}

RoundPipeOptions round_pipe_options(const LauncherConfig& config) {
  RunConfig run;
  run.num_microbatch = config.run.num_microbatch;
  run.recompute_grain = config.run.recompute;
  return RoundPipeOptions()
      .devices(devices_of_rank(config))
      .optim_dtype(config.model.master_dtype)
      .run_config(run)
      .seed(config.train.seed)
      .measure_layer_times(false);  // Note [Deterministic plans]
}

std::unique_ptr<TokenSource> open_data(const LauncherConfig& config, const std::string& path,
                                       uint64_t seed_offset) {
  switch (config.data.format) {
    case DataFormat::kTokens:
      return open_token_file(path);
    case DataFormat::kBytes:
      return open_byte_file(path);
    case DataFormat::kSynthetic:
      break;
  }
  const int64_t vocab = data_vocab_size(config).value_or(256);
  // Enough tokens for every training window to be fresh-looking; the stream is a pure function.
  return make_synthetic_tokens(config.train.seed + seed_offset, vocab, int64_t{1} << 24);
}

at::Tensor summed_token_loss(const at::Tensor& logits, const at::Tensor& labels) {
  const int64_t vocab = logits.size(-1);
  return at::cross_entropy_loss(logits.reshape({-1, vocab}).to(at::kFloat), labels.reshape({-1}),
                                /*weight=*/{}, at::Reduction::Sum);
}

double evaluate(RoundPipe& model, const LauncherConfig& config, const TokenSource& source) {
  EvalBatches batches(source, config.train.batch_size, config.data.seq_len, config.eval.max_batches);
  at::NoGradGuard no_grad;
  model.module()->eval();
  double total = 0.0;
  int64_t count = 0;
  while (std::optional<Batch> batch = batches.next()) {
    RunConfig run;
    run.num_microbatch = std::min<int64_t>(batch->inputs.size(0),
                                           config.run.num_microbatch.value_or(1));
    at::Tensor logits = model.forward({batch->inputs}, run);
    total += summed_token_loss(logits, batch->labels).item<double>();
    count += batch->labels.numel();
  }
  model.module()->train();
  return total / static_cast<double>(count);
}

}  // namespace roundpipe::launcher
