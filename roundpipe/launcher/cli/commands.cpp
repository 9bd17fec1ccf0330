#include "roundpipe/launcher/cli/commands.h"

#include <c10/util/Exception.h>
#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "roundpipe/launcher/atomic_file.h"
#include "roundpipe/launcher/cli/checkpoint.h"
#include "roundpipe/launcher/cli/memory_plan.h"
#include "roundpipe/launcher/cli/setup.h"
#include "roundpipe/launcher/metrics.h"
#include "roundpipe/models/layers.h"
#include "roundpipe/models/lora.h"
#include "roundpipe/models/model_config.h"
#include "roundpipe/run_config.h"
#include "scheduler/plan_preview.h"

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
    if (n < 0) {
      ok = false;
      break;
    }
    for (ssize_t done = 0; done < n;) {
      ssize_t w = ::write(out, buffer.data() + done, static_cast<size_t>(n - done));
      if (w <= 0) {
        ok = false;
        break;
      }
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

// The base model directory of a LoRA checkpoint: `requested`, else the adapter's
// base_model_name_or_path.
std::string lora_base_dir(const std::string& checkpoint_dir, const std::string& requested) {
  if (!requested.empty()) {
    TORCH_CHECK(is_regular_file(join_path(requested, "config.json")), "export --base: '", requested,
                "' holds no config.json (expected the Hugging Face directory the adapters were trained on)");
    return requested;
  }
  const std::string path = join_path(checkpoint_dir, "adapter_config.json");
  std::ifstream in(path);
  nlohmann::json json = nlohmann::json::parse(
      std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()), nullptr, false);
  const std::string base = json.is_object() && json.value("base_model_name_or_path", nlohmann::json()).is_string()
                               ? json["base_model_name_or_path"].get<std::string>()
                               : std::string();
  TORCH_CHECK(!base.empty() && is_regular_file(join_path(base, "config.json")), "export --merge: the base model '",
              base, "' named by ", path,
              " (base_model_name_or_path) is not a Hugging Face directory here: pass "
              "--base DIR (the model.pretrained of the LoRA run)");
  return base;
}

// Note [LoRA export]: the checkpoint's adapter_config.json + adapter_model.safetensors already are
// a PEFT adapter directory (fp32 masters); export copies them. --merge loads the base in float32,
// applies and folds the adapters (W + B A alpha / r, as PEFT's merge_and_unload) and saves the
// result in the base checkpoint's dtype, so the merged directory replaces the base one for one.
void export_lora(const std::string& checkpoint_dir, const std::string& out_dir, std::ostream& out,
                 const ExportOptions& options) {
  TORCH_CHECK(is_checkpoint_dir(checkpoint_dir), "export: '", checkpoint_dir,
              "' is not a checkpoint directory of `roundpipe train` (expected adapter_config.json and "
              "trainer_state.pt)");
  TORCH_CHECK(options.merge || options.base.empty(), "export: --base only applies with --merge");
  if (options.merge) {
    const std::string base = lora_base_dir(checkpoint_dir, options.base);
    models::Pretrained pre = models::load_pretrained(base, models::LoadOptions().dtype(at::kFloat));
    const std::optional<c10::ScalarType> base_dtype = pre.config.dtype;
    models::load_lora_adapter(pre.model, pre.config, checkpoint_dir);
    models::merge_lora(pre.model);
    models::SaveOptions save;
    if (base_dtype.has_value()) save.dtype(*base_dtype);
    make_directories(out_dir);
    models::save_pretrained(pre.model, pre.config, out_dir, save);
    out << "exported the merged model (base " << base << " + adapters of " << checkpoint_dir << ") to " << out_dir
        << " (load with transformers' AutoModelForCausalLM.from_pretrained)\n";
    return;
  }
  make_directories(out_dir);
  for (const char* name : {"adapter_config.json", "adapter_model.safetensors"}) {
    copy_file(join_path(checkpoint_dir, name), join_path(out_dir, name));
  }
  fsync_directory(out_dir);
  out << "exported the LoRA adapters of " << checkpoint_dir << " to " << out_dir
      << " (load with peft.PeftModel.from_pretrained(base_model, OUT_DIR); --merge writes the merged model)\n";
}

// Note [Config-only plans]:
// `roundpipe plan` needs the model's configuration and nothing else: no weights, no allocation, no
// GPU. Everything it prints comes from the shape (config.json with model.config laid over it, or
// the preset) through the memory model (scheduler/memory_model.h): the parameter counts, every
// layer's bytes, the runtime's size-based plan on run.devices (with CUDA devices, each stage
// within half of run.device_memory_gib, as RoundPipe's default budget is half the GPU's memory),
// the peaks and the timeline. So a 235B-parameter model plans in milliseconds on a laptop, for 8
// GPUs it does not have (run.devices=[cuda:0, ..., cuda:7] run.device_memory_gib=24). The
// memory model counts parameters as the models module allocates them (every expert of an MoE
// layer, gpt-oss's sinks and expert biases, LoRA adapters); cli_moe_plan_test.cpp checks the
// counts against `roundpipe train`'s, which come from the built model.

// "model: ...", the LoRA line and the parameter counts.
void print_model(const LauncherConfig& config, const models::ModelConfig& model_config, const MemoryPlan& memory,
                 std::ostream& out) {
  out << "model: " << models::model_type_name(model_config.architecture) << ", " << model_config.num_hidden_layers
      << " decoder layers, " << memory.params.total << " parameters, compute " << models::dtype_name(config.model.dtype)
      << ", masters " << models::dtype_name(config.model.master_dtype) << "\n";
  if (const std::optional<models::LoraOptions> lora = lora_options(config)) {
    out << "LoRA: rank " << lora->rank() << ", alpha " << lora->alpha() << " on";
    for (const std::string& t : lora->target_modules()) out << " " << t;
    for (const std::string& t : lora->target_parameters()) out << " " << t;
    out << "; the base is frozen (no master, gradient or optimizer state)";
    if (!config.model.lora->adapter.empty()) out << "; model.lora.adapter's adapter_config.json replaces these";
    out << "\n";
  }
  out << describe_parameter_counts({memory.params.trainable, memory.params.total}) << "\n";
}

// The size-based costs of the pipeline's layers (what RoundPipe plans with before any time is
// measured): their weights' bytes, and gradients' in backward.
std::vector<scheduler::LayerCost> layer_costs(const MemoryPlan& memory) {
  std::vector<int64_t> bytes, grads;
  for (const scheduler::LayerMemory& l : scheduler::layer_memory(memory.shape, memory.device_options)) {
    bytes.push_back(l.param_bytes);
    grads.push_back(l.grad_bytes);
  }
  return scheduler::size_based_costs(bytes, grads);
}

// The devices and every stage of the plan with its layers and bytes.
void print_stages(const MemoryPlan& memory, const std::vector<scheduler::LayerCost>& costs, std::ostream& out) {
  out << "devices (" << memory.devices.size() << "):";
  for (const c10::Device& d : memory.devices) out << " " << d.str();
  out << "\n";
  const auto num_layers = static_cast<int64_t>(costs.size());
  const scheduler::ExecutePlan& plan = memory.plan;
  out << "layers: " << num_layers << " (0 = embeddings, 1.." << num_layers - 2 << " = decoder layers, "
      << num_layers - 1 << " = norm + lm_head)\n";
  out << "stages (" << plan.num_stages() << "): forward stages, then backward stages deepest first; "
      << "the first backward stage runs forward + loss + backward fused\n";
  int index = 0;
  auto print_stage = [&](const char* kind, const scheduler::LayerRange& range, bool backward) {
    int64_t bytes = 0;
    for (int64_t l = range.begin; l < range.end; ++l) bytes += backward ? costs[l].backward_bytes : costs[l].bytes;
    out << "  stage " << index++ << "  " << kind << "  layers " << layer_span(range, num_layers) << "  "
        << format_bytes(bytes) << (backward ? " (parameters + gradients)" : " (parameters)") << "\n";
  };
  for (const auto& range : plan.forward_stages()) print_stage("fwd", range, false);
  for (const auto& range : plan.backward_stages()) print_stage("bwd", range, true);
}

// The plan's simulated timeline. Before any layer time is measured the costs are size-based
// (bytes): rescaled so that one iteration takes 100 (the simulator is linear in the costs).
void print_timeline(const LauncherConfig& config, const MemoryPlan& memory,
                    const std::vector<scheduler::LayerCost>& costs, const std::string& svg_path, std::ostream& out) {
  const int64_t num_microbatch = config.run.num_microbatch.value_or(default_num_microbatch(memory.num_devices));
  // The engine's own rules (Note [Engine self-model]); one isolated iteration, so whether
  // back-to-back iterations would overlap does not matter.
  const auto rules = engine_simulate_options(config.run.recompute, /*iterations_overlap=*/false);
  scheduler::SimulationResult sim =
      scheduler::simulate(memory.plan, scheduler::RunType::kFused, costs, memory.num_devices, num_microbatch, rules);
  if (sim.makespan > 0) {
    std::vector<scheduler::LayerCost> scaled = costs;
    for (scheduler::LayerCost& c : scaled) {
      c.forward *= 100.0 / sim.makespan;
      c.backward *= 100.0 / sim.makespan;
    }
    sim =
        scheduler::simulate(memory.plan, scheduler::RunType::kFused, scaled, memory.num_devices, num_microbatch, rules);
  }
  const auto preview = scheduler::PreviewOptions().set_time_unit("").set_title(
      "simulated timeline (size-based costs; one iteration = 100)");
  out << "\n" << scheduler::timeline_text(sim, preview);
  if (!svg_path.empty()) {
    write_file_atomically(svg_path, scheduler::timeline_svg(sim, preview));
    out << "timeline picture: " << svg_path << "\n";
  }
}

}  // namespace

void run_validate(const LauncherConfig& config, std::ostream& out) {
  models::ModelConfig model_config = resolve_model_config(config);
  check_supported(config, model_config);
  check_lora_targets(config, model_config);
  out << to_yaml(config);
}

void run_plan(const LauncherConfig& config, std::ostream& out, const std::string& svg_path) {
  // Note [Config-only plans]
  const models::ModelConfig model_config = resolve_model_config(config);
  check_supported(config, model_config);
  check_lora_targets(config, model_config);
  const MemoryPlan memory = plan_memory(config);
  print_model(config, model_config, memory, out);
  const std::vector<scheduler::LayerCost> costs = layer_costs(memory);
  print_stages(memory, costs, out);
  print_memory_plan(config, memory, out);
  print_timeline(config, memory, costs, svg_path, out);
}

void run_eval(const LauncherConfig& config, std::ostream& out) {
  const std::string& path = config.data.valid.empty() ? config.data.train : config.data.valid;
  const LauncherData data = open_data(config, path, config.data.valid.empty() ? 0 : 1);  // bad data: before loading
  LauncherModel pre = make_launcher_model(config);
  RoundPipe model(pre.model, round_pipe_options(config, models::draws_in_training(*pre.model)));
  const EvalResult result = evaluate(model, config, data);
  make_directories(config.out_dir);
  MetricsWriter metrics(config.out_dir, std::numeric_limits<int64_t>::max());
  metrics.log_eval({0, result.loss, result.accuracy});
  char text[96];
  out << "evaluated " << data.describe() << "\n";
  std::snprintf(text, sizeof(text), "eval_accuracy=%.6f\n", result.accuracy);
  out << text;
  std::snprintf(text, sizeof(text), "eval_loss=%.6f\n", result.loss);
  out << text;
}

void run_export(const std::string& checkpoint_dir, const std::string& out_dir, std::ostream& out,
                const ExportOptions& options) {
  if (is_lora_checkpoint_dir(checkpoint_dir)) {
    export_lora(checkpoint_dir, out_dir, out, options);
    return;
  }
  TORCH_CHECK(!options.merge, "export --merge: '", checkpoint_dir,
              "' is not a LoRA checkpoint (no "
              "adapter_config.json); a full checkpoint exports as it is, without --merge");
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
