#include "roundpipe/launcher/cli/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <dirent.h>
#include <fcntl.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <unistd.h>

#include <cstdlib>
#include <sstream>

#include "roundpipe/launcher/atomic_file.h"
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
  TORCH_CHECK(false, "injected failure (ROUNDPIPE_TEST_FAIL_AT=", spec, ") before publishing the "
              "checkpoint of step ", step);
}

}  // namespace

bool is_checkpoint_dir(const std::string& dir) {
  return is_regular_file(join_path(dir, kTrainerStateFile)) &&
         is_regular_file(join_path(dir, "config.json"));
}

std::string save_checkpoint_dir(CheckpointContents c) {
  c.model.synchronize();  // Note [Checkpoints are sync points]
  const std::string parent = join_path(c.config.out_dir, "checkpoints");
  make_directories(parent);
  const std::string final_dir = join_path(parent, step_dir_name(c.state.step));
  const std::string staging = make_staging_directory(final_dir);

  models::save_pretrained(c.model, c.model_config, staging);
  fsync_files_in(staging);  // save_pretrained's files (write_file_atomically fsyncs its own)
  {
    torch::serialize::OutputArchive archive;
    c.optimizer.save(archive);
    write_file_atomically(join_path(staging, kOptimizerFile), archive_bytes(archive));
  }
  {
    torch::serialize::OutputArchive archive;
    archive.write("step", at::scalar_tensor(c.state.step, at::kLong));
    archive.write("tokens", at::scalar_tensor(c.state.tokens, at::kLong));
    archive.write("world_size", at::scalar_tensor(c.state.world_size, at::kLong));
    archive.write("sampler_state",
                  at::scalar_tensor(static_cast<int64_t>(c.state.sampler_state), at::kLong));
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
              kTrainerStateFile, " and config.json)");
  return dir;
}

TrainerState load_checkpoint_dir(const std::string& dir, RoundPipe& model,
                                 const models::ModelConfig& model_config,
                                 torch::optim::Optimizer& optimizer) {
  models::CheckpointReader reader = models::CheckpointReader::open(dir);
  auto get = [&](const std::string& name) {
    TORCH_CHECK(reader.contains(name), "checkpoint '", dir, "' has no tensor '", name,
                "': it was written for another model");
    return reader.get(name);
  };
  // Compute copies (rounded to model.dtype) and exact master values.
  torch::nn::Sequential module = model.module();
  models::load_hf_state_dict(module, model_config, get);
  {
    at::NoGradGuard no_grad;
    OptimizerCtx ctx;
    for (const auto& [name, master] : model.optim_named_parameters()) {
      const std::string hf_name = models::hf_parameter_name(name, model_config.num_hidden_layers);
      at::Tensor saved = get(hf_name);
      TORCH_CHECK(saved.sizes() == master.sizes(), "checkpoint '", dir, "': tensor '", hf_name,
                  "' has shape ", saved.sizes(), " but the model's is ", master.sizes());
      master.copy_(saved);
    }
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
  archive.read("cpu_rng_state", state.cpu_rng_state);
  torch::serialize::InputArchive scaler;
  archive.read("scaler", scaler);
  state.scaler.load(scaler);
  return state;
}

}  // namespace roundpipe::launcher
