#include "roundpipe/launcher/cli/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <dirent.h>
#include <fcntl.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "roundpipe/launcher/atomic_file.h"
#include "roundpipe/launcher/cli/setup.h"
#include "roundpipe/models/lora.h"
#include "roundpipe/models/pretrained.h"
#include "roundpipe/models/safetensors.h"

namespace roundpipe::launcher {
namespace {

// Note [Checkpoints are sync points]:
// In async step mode the optimizer step of iteration i may still run while iteration i + 1's
// forward/backward starts on the weights before it (staleness one). A checkpoint first waits for
// every queued step (RoundPipe::synchronize), so it holds the weights after exactly `step` steps;
// the run then continues from those synchronized weights. A run resumed from the checkpoint starts
// from the same synchronized state, which is why a straight run and a resumed run give bitwise
// equal weights in async mode too (tested), at the price of one pipeline drain per checkpoint.

constexpr const char* kTrainerStateFile = "trainer_state.pt";
constexpr const char* kOptimizerFile = "optimizer.pt";
constexpr const char* kAdapterConfigFile = "adapter_config.json";
constexpr const char* kAdapterWeightsFile = "adapter_model.safetensors";
// PEFT's prefix of an adapter tensor's name before the HF parameter name.
constexpr const char* kPeftPrefix = "base_model.model.";

void fsync_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "cannot open '", path, "' to fsync it");
  int rc = ::fsync(fd);
  ::close(fd);
  TORCH_CHECK(rc == 0, "fsync of '", path, "' failed");
}

void fsync_files_in(const std::string& dir) {
  DIR* handle = ::opendir(dir.c_str());
  TORCH_CHECK(handle != nullptr, "cannot list '", dir, "'");
  while (dirent* entry = ::readdir(handle)) {
    const std::string path = join_path(dir, entry->d_name);
    if (entry->d_name[0] != '.' && is_regular_file(path)) fsync_file(path);
  }
  ::closedir(handle);
}

// Streams `archive` into a new file at `path` (Note [Checkpoint host memory]). torch's own
// save_to(filename) aborts the process when a write fails (disk full): its zip writer's destructor
// throws a second time. So the writer given to torch never reports a short write; the first
// failure is remembered, later chunks are dropped, and the error is thrown here once torch is done.
void save_archive_to_file(torch::serialize::OutputArchive& archive, const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "cannot create '", path, "': ", std::strerror(errno),
              "; check that the directory exists and is writable");
  int error = 0;
  archive.save_to([&](const void* data, size_t size) -> size_t {
    if (error == 0) error = write_fully(fd, static_cast<const char*>(data), size);
    return size;
  });
  if (::close(fd) != 0 && error == 0) error = errno;
  TORCH_CHECK(error == 0, "writing '", path, "' failed: ", std::strerror(error), " (errno ", error,
              "); check free disk space, quotas and file-size limits");
}

std::string archive_bytes(torch::serialize::OutputArchive& archive) {
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

// ROUNDPIPE_TEST_FAIL_AT=checkpoint-publish[@STEP]: throws between writing the staging directory
// and publishing it (the checkpoint atomicity test).
void maybe_inject_failure(int64_t step) {
  const char* env = std::getenv("ROUNDPIPE_TEST_FAIL_AT");
  if (env == nullptr) return;
  std::string spec(env);
  const std::string point = "checkpoint-publish";
  if (spec.rfind(point, 0) != 0) return;
  if (spec.size() > point.size()) {
    if (spec[point.size()] != '@' || std::stoll(spec.substr(point.size() + 1)) != step) return;
  }
  TORCH_CHECK(false, "injected failure (ROUNDPIPE_TEST_FAIL_AT=", spec,
              ") before publishing the "
              "checkpoint of step ",
              step);
}

}  // namespace

bool is_lora_checkpoint_dir(const std::string& dir) { return is_regular_file(join_path(dir, kAdapterConfigFile)); }

bool is_checkpoint_dir(const std::string& dir) {
  return is_regular_file(join_path(dir, kTrainerStateFile)) &&
         (is_regular_file(join_path(dir, "config.json")) || is_lora_checkpoint_dir(dir));
}

// Note [Checkpoint host memory]:
// A checkpoint must not cost host memory in proportion to the model: the weights go to safetensors
// one tensor at a time (models::save_safetensors), and the optimizer state (8 B/param for Adam)
// is written by the archive straight into its file in the staging directory. Serializing it into
// a std::string first, as small files here still are, held the archive twice (the ostringstream
// and its str() copy): +16 B/param at the moment of the checkpoint, measured as the run's peak
// (issue 31, docs/benchmarks.md "Host memory, and what bounds the largest model").
std::string save_checkpoint_dir(CheckpointContents c) {
  c.model.synchronize();  // Note [Checkpoints are sync points]
  const std::string parent = join_path(c.config.out_dir, "checkpoints");
  make_directories(parent);
  const std::string final_dir = join_path(parent, step_dir_name(c.state.step));
  const std::string staging = make_staging_directory(final_dir);

  if (c.lora != nullptr) {
    // Note [LoRA in the launcher]: the adapters' masters only; the base is model.pretrained.
    models::save_lora_adapter(c.model, c.model_config, *c.lora, staging, lora_base_model_path(c.config));
  } else {
    models::save_pretrained(c.model, c.model_config, staging);
  }
  {
    // Note [Checkpoint host memory]: streamed into the staging directory (published whole by its
    // rename below), never held in memory; fsync_files_in makes it durable.
    torch::serialize::OutputArchive archive;
    c.optimizer.save(archive);
    save_archive_to_file(archive, join_path(staging, kOptimizerFile));
  }
  fsync_files_in(staging);  // the models library's files and the optimizer state
  {
    torch::serialize::OutputArchive archive;
    archive.write("step", at::scalar_tensor(c.state.step, at::kLong));
    archive.write("tokens", at::scalar_tensor(c.state.tokens, at::kLong));
    archive.write("world_size", at::scalar_tensor(c.state.world_size, at::kLong));
    archive.write("iteration", at::scalar_tensor(c.state.iteration, at::kLong));
    archive.write("sampler_state", at::scalar_tensor(static_cast<int64_t>(c.state.sampler_state), at::kLong));
    archive.write("cpu_rng_state", c.state.cpu_rng_state);
    torch::serialize::OutputArchive scaler;
    c.state.scaler.save(scaler);
    archive.write("scaler", scaler);
    write_file_atomically(join_path(staging, kTrainerStateFile), archive_bytes(archive));
  }
  write_file_atomically(join_path(staging, "config.yaml"), to_yaml(c.config));

  maybe_inject_failure(c.state.step);
  publish_directory(staging, final_dir);
  update_symlink_atomically(join_path(parent, "latest"), step_dir_name(c.state.step));
  prune_step_dirs(parent, c.config.checkpoint.keep);
  return final_dir;
}

std::string resolve_resume_dir(const LauncherConfig& config, const std::string& requested) {
  std::string dir = requested;
  if (dir.empty()) {
    const std::string link = join_path(join_path(config.out_dir, "checkpoints"), "latest");
    std::optional<std::string> target = read_symlink(link);
    TORCH_CHECK(target.has_value(), "--resume: no checkpoint to resume from: '", link,
                "' does not exist (train with checkpoint.every > 0 first, or pass --resume DIR)");
    dir = (*target)[0] == '/' ? *target : join_path(parent_directory(link), *target);
  }
  TORCH_CHECK(is_checkpoint_dir(dir), "--resume: '", dir, "' is not a checkpoint directory (it has no ",
              kTrainerStateFile, " and config.json or ", kAdapterConfigFile, ")");
  return dir;
}

namespace {

// The checkpoint's adapter_config.json must describe the adapters of the run's model.
void check_adapter_config(const std::string& dir, const models::LoraOptions& lora) {
  const std::string path = join_path(dir, kAdapterConfigFile);
  std::ifstream in(path);
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()));
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "checkpoint '", dir, "': ", path, " is not valid JSON: ", e.what());
  }
  const int64_t rank = json.value("r", int64_t{-1});
  const double alpha = json.value("lora_alpha", -1.0);
  TORCH_CHECK(rank == lora.rank() && alpha == lora.alpha(), "checkpoint '", dir,
              "' holds LoRA adapters with r = ", rank, ", lora_alpha = ", alpha, " but the run's model.lora has rank ",
              lora.rank(), ", alpha ", lora.alpha(), ": resume with the configuration of that run");
}

// Copies each trainable parameter of `module` (compute copy) and each master from `get(hf_name)`.
void load_weights(RoundPipe& model, const models::ModelConfig& model_config, bool trainable_only,
                  const std::string& dir, const std::function<at::Tensor(const std::string&)>& get) {
  torch::nn::Sequential module = model.module();
  at::NoGradGuard no_grad;
  if (trainable_only) {
    for (const auto& item : module->named_parameters()) {
      if (!item.value().requires_grad()) continue;
      const std::string hf_name = models::hf_parameter_name(item.key(), model_config.num_hidden_layers);
      at::Tensor saved = get(hf_name);
      TORCH_CHECK(saved.sizes() == item.value().sizes(), "checkpoint '", dir, "': tensor '", hf_name, "' has shape ",
                  saved.sizes(), " but the model's is ", item.value().sizes());
      item.value().copy_(saved);
    }
  } else {
    models::load_hf_state_dict(module, model_config, get);
  }
  OptimizerCtx ctx;
  for (const auto& [name, master] : model.optim_named_parameters()) {
    const std::string hf_name = models::hf_parameter_name(name, model_config.num_hidden_layers);
    at::Tensor saved = get(hf_name);
    TORCH_CHECK(saved.sizes() == master.sizes(), "checkpoint '", dir, "': tensor '", hf_name, "' has shape ",
                saved.sizes(), " but the model's is ", master.sizes());
    master.copy_(saved);
  }
}

}  // namespace

TrainerState load_checkpoint_dir(const std::string& dir, RoundPipe& model, const models::ModelConfig& model_config,
                                 torch::optim::Optimizer& optimizer, const models::LoraOptions* lora) {
  const bool lora_checkpoint = is_lora_checkpoint_dir(dir);
  TORCH_CHECK(!lora_checkpoint || lora != nullptr, "checkpoint '", dir,
              "' is a LoRA checkpoint (adapters only) "
              "but this run trains every weight: set model.lora as in that run (or train from a merged "
              "export: roundpipe export --merge)");
  TORCH_CHECK(lora_checkpoint || lora == nullptr, "checkpoint '", dir,
              "' holds a full model, not LoRA adapters, "
              "but this run has model.lora: remove model.lora to resume it (or set model.pretrained to it to "
              "start LoRA from those weights)");
  // Compute copies (rounded to model.dtype) and exact master values.
  if (lora_checkpoint) {
    check_adapter_config(dir, *lora);
    auto file = models::SafetensorsFile::open(join_path(dir, kAdapterWeightsFile));
    std::map<std::string, std::string> peft_names;  // HF name -> PEFT key (expert adapters differ)
    for (const auto& [sequential, peft] : models::lora_parameter_names(model.module())) {
      peft_names[models::hf_parameter_name(sequential, model_config.num_hidden_layers)] = peft;
    }
    load_weights(model, model_config, /*trainable_only=*/true, dir, [&](const std::string& name) {
      const auto it = peft_names.find(name);
      const std::string peft_name = it != peft_names.end() ? it->second : kPeftPrefix + name;
      TORCH_CHECK(file->contains(peft_name), "checkpoint '", dir, "' has no adapter tensor '", peft_name,
                  "': it was written with other model.lora.targets or another model");
      return file->get(peft_name);
    });
  } else {
    models::CheckpointReader reader = models::CheckpointReader::open(dir);
    load_weights(model, model_config, /*trainable_only=*/false, dir, [&](const std::string& name) {
      TORCH_CHECK(reader.contains(name), "checkpoint '", dir, "' has no tensor '", name,
                  "': it was written for another model");
      return reader.get(name);
    });
  }
  {
    torch::serialize::InputArchive archive;
    archive.load_from(join_path(dir, kOptimizerFile));
    optimizer.load(archive);
  }
  TrainerState state;
  torch::serialize::InputArchive archive;
  archive.load_from(join_path(dir, kTrainerStateFile));
  at::Tensor value;
  archive.read("step", value);
  state.step = value.item<int64_t>();
  archive.read("tokens", value);
  state.tokens = value.item<int64_t>();
  archive.read("sampler_state", value);
  state.sampler_state = static_cast<uint64_t>(value.item<int64_t>());
  if (archive.try_read("world_size", value)) state.world_size = value.item<int64_t>();  // older: 1
  if (archive.try_read("iteration", value)) state.iteration = value.item<int64_t>();    // older: -1
  archive.read("cpu_rng_state", state.cpu_rng_state);
  torch::serialize::InputArchive scaler;
  archive.read("scaler", scaler);
  state.scaler.load(scaler);
  return state;
}

}  // namespace roundpipe::launcher
