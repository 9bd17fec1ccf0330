#include "roundpipe/launcher/cli/commands.h"

#include <c10/util/Exception.h>
#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iomanip>
#include <limits>
#include <sstream>
#include <vector>

#include "roundpipe/launcher/atomic_file.h"
#include "roundpipe/launcher/cli/checkpoint.h"
#include "roundpipe/launcher/cli/setup.h"
#include "roundpipe/launcher/metrics.h"

namespace roundpipe::launcher {
namespace {

std::string format_bytes(int64_t bytes) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(2);
  const double b = static_cast<double>(bytes);
  if (b >= (1LL << 30)) {
    out << b / (1LL << 30) << " GiB";
  } else if (b >= (1LL << 20)) {
    out << b / (1LL << 20) << " MiB";
  } else {
    out << b / 1024.0 << " KiB";
  }
  return out.str();
}

std::string layer_name(int64_t layer, int64_t num_layers) {
  if (layer == 0) return "embeddings";
  if (layer == num_layers - 1) return "norm + lm_head";
  return "decoder " + std::to_string(layer - 1);
}

std::string layer_span(const scheduler::LayerRange& range, int64_t num_layers) {
  std::string text = range.to_string() + " " + layer_name(range.begin, num_layers);
  if (range.size() > 1) text += " .. " + layer_name(range.end - 1, num_layers);
  return text;
}

// Streams `from` into `to` (written atomically: Note [Atomic publish]) without holding it all.
void copy_file(const std::string& from, const std::string& to) {
  const std::string tmp = to + ".tmp.export";
  int in = ::open(from.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(in >= 0, "export: cannot read '", from, "'");
  int out = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out < 0) {
    ::close(in);
    TORCH_CHECK(false, "export: cannot write '", tmp, "'");
  }
  std::vector<char> buffer(1 << 20);
  bool ok = true;
  for (;;) {
    ssize_t n = ::read(in, buffer.data(), buffer.size());
    if (n == 0) break;
    if (n < 0) { ok = false; break; }
    for (ssize_t done = 0; done < n;) {
      ssize_t w = ::write(out, buffer.data() + done, static_cast<size_t>(n - done));
      if (w <= 0) { ok = false; break; }
      done += w;
    }
    if (!ok) break;
  }
  ok = ok && ::fsync(out) == 0;
  ::close(in);
  ::close(out);
  TORCH_CHECK(ok, "export: copying '", from, "' to '", tmp, "' failed");
  TORCH_CHECK(::rename(tmp.c_str(), to.c_str()) == 0, "export: cannot rename '", tmp, "' to '", to, "'");
}

}  // namespace

void run_validate(const LauncherConfig& config, std::ostream& out) {
  models::ModelConfig model_config = resolve_model_config(config);
  check_supported(config, model_config);
  out << to_yaml(config);
}

void run_plan(const LauncherConfig& config, std::ostream& out) {
  models::Pretrained pre = make_launcher_model(config, /*allocate_only=*/true);
  RoundPipe model(pre.model, round_pipe_options(config));
  const int64_t num_layers = model.num_layers();
  const std::vector<scheduler::LayerCost> costs = model.layer_costs();
  int64_t numel = 0;
  for (const at::Tensor& p : models::unique_parameters(*pre.model)) numel += p.numel();

  out << "model: " << pre.config.model_type << ", " << pre.config.num_hidden_layers
      << " decoder layers, " << numel << " parameters, compute " << dtype_name(config.model.dtype)
      << ", masters " << dtype_name(config.model.master_dtype) << "\n";
  out << "devices (" << model.devices().size() << "):";
  for (const c10::Device& d : model.devices()) out << " " << d.str();
  out << "\n";
  const scheduler::ExecutePlan plan = model.plan();
  out << "layers: " << num_layers << " (0 = embeddings, 1.." << num_layers - 2
      << " = decoder layers, " << num_layers - 1 << " = norm + lm_head)\n";
  out << "stages (" << plan.num_stages() << "): forward stages, then backward stages deepest first; "
      << "the first backward stage runs forward + loss + backward fused\n";
  int64_t largest = 0;
  int index = 0;
  auto print_stage = [&](const char* kind, const scheduler::LayerRange& range, bool backward) {
    int64_t bytes = 0;
    for (int64_t l = range.begin; l < range.end; ++l) {
      bytes += backward ? costs[l].backward_bytes : costs[l].bytes;
    }
    largest = std::max(largest, bytes);
    out << "  stage " << index++ << "  " << kind << "  layers " << layer_span(range, num_layers)
        << "  " << format_bytes(bytes) << (backward ? " (parameters + gradients)" : " (parameters)")
        << "\n";
  };
  for (const auto& range : plan.forward_stages()) print_stage("fwd", range, false);
  for (const auto& range : plan.backward_stages()) print_stage("bwd", range, true);

  const int64_t compute = numel * static_cast<int64_t>(c10::elementSize(config.model.dtype));
  const int64_t master = numel * static_cast<int64_t>(c10::elementSize(config.model.master_dtype));
  int64_t optimizer_state = 0;
  switch (config.optimizer.name) {
    case OptimizerName::kAdam:
    case OptimizerName::kAdamW:
      optimizer_state = 2 * master;
      break;
    case OptimizerName::kSgd:
      optimizer_state = config.optimizer.momentum != 0.0 ? master : 0;
      break;
  }
  const bool separate_masters = config.model.dtype != config.model.master_dtype;
  const int64_t host = compute + (separate_masters ? master : 0) + master /*gradients*/ + optimizer_state;
  out << "estimated host memory: " << format_bytes(host) << " = compute weights "
      << format_bytes(compute);
  if (separate_masters) out << " + master weights " << format_bytes(master);
  out << " + master gradients " << format_bytes(master) << " + optimizer state "
      << format_bytes(optimizer_state) << " (activations and data not included)\n";
  out << "estimated device memory: " << format_bytes(2 * largest)
      << " per device = 2 x the largest stage " << format_bytes(largest)
      << " (one running, one prefetched; activations not included)\n";
}

void run_eval(const LauncherConfig& config, std::ostream& out) {
  models::Pretrained pre = make_launcher_model(config);
  const std::string& path = config.data.valid.empty() ? config.data.train : config.data.valid;
  std::unique_ptr<TokenSource> data = open_data(config, path, config.data.valid.empty() ? 0 : 1);
  RoundPipe model(pre.model, round_pipe_options(config));
  const double loss = evaluate(model, config, *data);
  make_directories(config.out_dir);
  MetricsWriter metrics(config.out_dir, std::numeric_limits<int64_t>::max());
  metrics.log_eval({0, loss});
  char text[64];
  std::snprintf(text, sizeof(text), "%.6f", loss);
  out << "evaluated " << data->describe() << "\n";
  out << "eval_loss=" << text << "\n";
}

void run_export(const std::string& checkpoint_dir, const std::string& out_dir, std::ostream& out) {
  if (is_regular_file(join_path(checkpoint_dir, "adapter_config.json"))) {
    TORCH_CHECK(false, "export: '", checkpoint_dir, "' is a LoRA checkpoint; exporting PEFT adapters "
                "is not available yet (issue 13)");
  }
  TORCH_CHECK(is_checkpoint_dir(checkpoint_dir), "export: '", checkpoint_dir,
              "' is not a checkpoint directory of `roundpipe train` (expected config.json and "
              "trainer_state.pt, e.g. runs/x/checkpoints/latest)");
  make_directories(out_dir);
  DIR* handle = ::opendir(checkpoint_dir.c_str());
  TORCH_CHECK(handle != nullptr, "export: cannot list '", checkpoint_dir, "'");
  std::vector<std::string> names;
  while (dirent* entry = ::readdir(handle)) {
    const std::string name = entry->d_name;
    const bool safetensors = name.size() > 12 && name.rfind(".safetensors") == name.size() - 12;
    if (name == "config.json" || safetensors || name == "model.safetensors.index.json") {
      names.push_back(name);
    }
  }
  ::closedir(handle);
  for (const std::string& name : names) {
    copy_file(join_path(checkpoint_dir, name), join_path(out_dir, name));
  }
  fsync_directory(out_dir);
  out << "exported " << names.size() << " files from " << checkpoint_dir << " to " << out_dir
      << " (load with transformers' AutoModelForCausalLM.from_pretrained)\n";
}

}  // namespace roundpipe::launcher
