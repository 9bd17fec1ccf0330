#include "roundpipe/launcher/cli/memory_plan.h"

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "roundpipe/devices.h"
#include "roundpipe/launcher/cli/setup.h"
#include "roundpipe/models/architecture.h"
#include "roundpipe/models/model_config.h"
#include "roundpipe/run_config.h"

namespace roundpipe::launcher {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// "1.25 GiB", "3.50 MiB", "0.42 KiB".
std::string gib(int64_t bytes) {
  char text[32];
  const double b = static_cast<double>(bytes);
  if (b >= kGiB) {
    std::snprintf(text, sizeof(text), "%.2f GiB", b / kGiB);
  } else if (b >= 1024.0 * 1024.0) {
    std::snprintf(text, sizeof(text), "%.2f MiB", b / (1024.0 * 1024.0));
  } else {
    std::snprintf(text, sizeof(text), "%.2f KiB", b / 1024.0);
  }
  return text;
}

// "433.41 KiB (443808 B)": exact for tests and scripts.
std::string exact(int64_t bytes) { return gib(bytes) + " (" + std::to_string(bytes) + " B)"; }

std::string per_param(int64_t bytes, int64_t params) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f B/param", params > 0 ? static_cast<double>(bytes) / params : 0.0);
  return text;
}

std::string stage_name(const scheduler::StageMemory& m, int64_t index) {
  std::ostringstream out;
  out << "stage " << index << " ("
      << (m.fused      ? "fused"
          : m.backward ? "bwd"
                       : "fwd")
      << ", layers " << m.layers.to_string() << ")";
  return out.str();
}

std::string terms(const scheduler::StageMemory& m) {
  std::string text = "weights " + gib(m.weights);
  if (m.backward) text += " + gradients " + gib(m.grads) + " + saved activations " + gib(m.saved_activations);
  text += " + one layer's intermediates " + gib(m.recompute);
  if (m.head > 0) text += " + LM head/loss " + gib(m.head);
  return text + " + stage inputs/outputs " + gib(m.boundary);
}

scheduler::TransformerShape shape_of(const LauncherConfig& config) {
  const models::ModelConfig m = resolve_model_config(config);
  scheduler::TransformerShape s;
  s.vocab = m.vocab_size;
  s.hidden = m.hidden_size;
  s.intermediate = m.intermediate_size;
  s.num_layers = m.num_hidden_layers;
  s.heads = m.num_attention_heads;
  s.kv_heads = m.num_key_value_heads;
  s.head_dim = m.head_dim;
  s.qk_norm = models::architecture_traits(m.architecture).qk_norm;
  s.attention_bias = m.attention_bias;
  s.attention_sinks = models::architecture_traits(m.architecture).attention_sinks;
  s.mlp_bias = m.mlp_bias;
  s.tied_embeddings = m.tie_word_embeddings;
  if (m.is_moe()) {
    s.experts = m.num_experts;
    s.experts_per_token = m.num_experts_per_tok;
    s.moe_intermediate = m.moe_intermediate_size > 0 ? m.moe_intermediate_size : m.intermediate_size;
    s.expert_bias = m.architecture == models::Architecture::kGptOss;  // as models::Experts allocates them
    for (int64_t i = 0; i < m.num_hidden_layers; ++i) s.sparse_layers.push_back(m.layer_is_sparse(i));
  }
  if (const auto lora = lora_options(config)) {
    s.lora_rank = lora->rank();
    s.lora_targets = lora->target_modules();
    s.lora_expert_targets = lora->target_parameters();
  }
  return s;
}

scheduler::OptimizerStateKind optimizer_kind(const OptimizerSection& o) {
  switch (o.name) {
    case OptimizerName::kAdam:
    case OptimizerName::kAdamW:
      return o.state_dtype == OptimizerStateDtype::kInt8 ? scheduler::OptimizerStateKind::kAdamInt8
                                                         : scheduler::OptimizerStateKind::kAdamFloat32;
    case OptimizerName::kLion:
      return scheduler::OptimizerStateKind::kOneMasterSized;
    case OptimizerName::kAdafactor:
      return scheduler::OptimizerStateKind::kFactored;
    case OptimizerName::kSgd:
      return o.momentum != 0.0 ? scheduler::OptimizerStateKind::kOneMasterSized : scheduler::OptimizerStateKind::kNone;
  }
  return scheduler::OptimizerStateKind::kAdamFloat32;
}

int64_t largest_total(const std::vector<scheduler::StageMemory>& stages, size_t* at = nullptr) {
  int64_t largest = 0;
  for (size_t i = 0; i < stages.size(); ++i) {
    if (stages[i].total() > largest) {
      largest = stages[i].total();
      if (at != nullptr) *at = i;
    }
  }
  return largest;
}

// The host prediction for a config whose device side is `memory` (CPU devices: the stages running
// at once, one per device, are host memory too).
scheduler::HostMemory host_of(const LauncherConfig& config, const MemoryPlan& memory) {
  scheduler::HostMemoryOptions o;
  o.compute_bytes = static_cast<int64_t>(c10::elementSize(config.model.dtype));
  o.master_bytes = static_cast<int64_t>(c10::elementSize(config.model.master_dtype));
  o.optimizer = optimizer_kind(config.optimizer);
  if (o.optimizer == scheduler::OptimizerStateKind::kFactored) {
    o.factored_state_bytes = scheduler::factored_state_bytes(memory.shape);
  }
  o.async_step = config.run.step_mode == StepMode::kAsync;
  o.in_place_masters = in_place_masters(config);
  o.grads_in_compute_dtype = master_grad_dtype(config).has_value();
  o.kahan_sum = config.optimizer.kahan_sum;
  if (memory.cpu_devices) {
    o.cpu_device_bytes = scheduler::cpu_device_bytes(
        memory.plan, memory.shape, memory.device_options, memory.num_devices,
        config.run.step_mode == StepMode::kSync ? scheduler::CpuDeviceLayers::kShared
                                                : scheduler::CpuDeviceLayers::kTrainableCopied);
  }
  o.saved_inputs =
      scheduler::saved_input_bytes(memory.plan, memory.shape, memory.device_options, memory.num_microbatch);
  return scheduler::host_memory(memory.params, o);
}

void set_stages(const LauncherConfig& config, MemoryPlan& memory) {
  memory.stages = scheduler::stage_memory(memory.plan, memory.shape, memory.device_options);
  memory.host = host_of(config, memory);
}

bool fits(const std::vector<scheduler::StageMemory>& stages, int64_t bytes) { return largest_total(stages) <= bytes; }

}  // namespace

MemoryPlan plan_memory(const LauncherConfig& config, const std::optional<scheduler::ExecutePlan>& plan) {
  MemoryPlan memory;
  memory.shape = shape_of(config);
  memory.params = scheduler::count_parameters(memory.shape);
  memory.devices = round_pipe_options(config).devices();
  const std::vector<c10::Device>& devices = memory.devices;
  memory.num_devices = std::max<int64_t>(1, static_cast<int64_t>(devices.size()));
  memory.cpu_devices = std::any_of(devices.begin(), devices.end(), [](const c10::Device& d) { return !d.is_cuda(); });
  scheduler::DeviceMemoryOptions& o = memory.device_options;
  o.dtype_bytes = static_cast<int64_t>(c10::elementSize(config.model.dtype));
  o.seq_len = config.data.seq_len;
  const int64_t num_microbatch = config.run.num_microbatch.value_or(default_num_microbatch(memory.num_devices));
  o.microbatch_rows = std::max<int64_t>(1, (config.train.batch_size + num_microbatch - 1) / num_microbatch);
  memory.num_microbatch = (config.train.batch_size + o.microbatch_rows - 1) / o.microbatch_rows;
  o.layer_recompute = config.run.recompute == RecomputeGrain::kLayer;
  o.loss_chunk_bytes = config.run.loss_chunk_mib << 20;
  o.repeat_kv = memory.cpu_devices;
  if (config.run.device_memory_gib.has_value()) {
    memory.device_bytes = static_cast<int64_t>(*config.run.device_memory_gib * kGiB);
  } else {
    for (const c10::Device& d : devices) {
      if (!d.is_cuda()) continue;
      const int64_t bytes = cuda_device_memory_bytes(d.index() < 0 ? 0 : d.index());
      if (bytes <= 0) {
        throw ConfigError("run.devices: " + d.str() +
                          " is not a visible CUDA device, so its memory is unknown; to plan for GPUs this machine "
                          "does not have, set run.device_memory_gib (e.g. run.device_memory_gib=24)");
      }
      memory.device_bytes = memory.device_bytes ? std::min(*memory.device_bytes, bytes) : bytes;
    }
  }
  memory.reserved_bytes = memory.cpu_devices ? 0 : kCudaReservedBytes;
  // RoundPipe's default budget on GPUs: half the smallest one's memory (round_pipe.cpp).
  const bool any_cuda = std::any_of(devices.begin(), devices.end(), [](const c10::Device& d) { return d.is_cuda(); });
  if (any_cuda && memory.device_bytes) memory.memory_budget_bytes = *memory.device_bytes / 2;
  try {
    memory.plan =
        plan ? *plan : scheduler::runtime_plan(memory.shape, o, memory.num_devices, memory.memory_budget_bytes);
  } catch (const c10::Error& e) {  // a layer alone over RoundPipe's per-stage budget
    throw ConfigError(std::string(config.run.device_memory_gib ? "run.device_memory_gib" : "device memory") +
                      ": no plan fits RoundPipe's per-stage budget of half the device's memory (" +
                      gib(memory.memory_budget_bytes) + "): " + e.what_without_backtrace() +
                      "; use GPUs with more memory (docs/user-guide.md, \"Planning memory\")");
  }
  set_stages(config, memory);
  return memory;
}

void print_memory_plan(const LauncherConfig& config, const MemoryPlan& memory, std::ostream& out) {
  const scheduler::DeviceMemoryOptions& o = memory.device_options;
  out << "memory model (scheduler/memory_model.cpp, Note [Memory model]): data.seq_len " << o.seq_len << ", "
      << o.microbatch_rows << " row(s) a microbatch, run.recompute " << (o.layer_recompute ? "layer" : "stage") << ", "
      << (memory.cpu_devices ? "CPU" : "CUDA") << " devices\n";
  for (size_t i = 0; i < memory.stages.size(); ++i) {
    const scheduler::StageMemory& m = memory.stages[i];
    out << "  " << stage_name(m, static_cast<int64_t>(i)) << "  peak " << exact(m.total()) << " = " << terms(m) << "\n";
  }
  size_t at = 0;
  const int64_t peak = largest_total(memory.stages, &at);
  out << "estimated device memory: peak " << exact(peak) << " (stage " << at << ")";
  if (memory.device_bytes) {
    out << " of " << gib(*memory.device_bytes)
        << (config.run.device_memory_gib ? " (run.device_memory_gib)" : " (the GPU)");
    if (memory.reserved_bytes > 0) out << " less " << gib(memory.reserved_bytes) << " reserved for CUDA";
    out << (peak <= *memory.device_bytes - memory.reserved_bytes ? ": fits"
                                                                 : ": DOES NOT FIT (roundpipe train refuses it)");
  }
  out << "\n";
  std::vector<int64_t> sizes;
  if (memory.device_bytes) {
    sizes.push_back(*memory.device_bytes);
  } else {
    sizes = {int64_t{24} << 30, int64_t{80} << 30};
  }
  for (int64_t bytes : sizes) {
    const int64_t usable = bytes - memory.reserved_bytes;
    const int64_t with_plan =
        scheduler::max_seq_len(memory.shape, o, memory.num_devices, usable, true, 1024, memory.memory_budget_bytes);
    const int64_t cut = scheduler::max_seq_len(memory.shape, o, memory.num_devices, usable, false);
    out << "longest data.seq_len under " << gib(bytes) << " (multiples of 1024, " << o.microbatch_rows
        << " row(s) a microbatch): " << with_plan << " with this plan, " << cut << " with stages cut by memory\n";
  }
  const scheduler::HostMemory& h = memory.host;
  out << "estimated host memory: peak " << exact(h.total()) << " = " << per_param(h.total(), memory.params.total)
      << " x " << memory.params.total << " parameters: compute copies " << gib(h.compute_copies) << " + masters "
      << (in_place_masters(config) ? std::string("0 (the compute copies)") : gib(h.masters)) << " + gradients "
      << gib(h.grads);
  if (const auto grad_dtype = master_grad_dtype(config)) {
    out << " (" << models::dtype_name(*grad_dtype) << ", read by the optimizer as they are)";
  }
  out << " + optimizer state " << gib(h.optimizer_state);
  if (h.cpu_devices > 0) out << " + CPU devices' stages " << gib(h.cpu_devices);
  if (h.saved_inputs > 0) out << " + layer inputs kept for the recompute " << gib(h.saved_inputs);
  if (const auto available = available_host_bytes()) out << " (MemAvailable " << gib(*available) << ")";
  out << "\n";
}

std::optional<int64_t> available_host_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (in >> key >> kib) {
    std::getline(in, unit);
    if (key == "MemAvailable:") return kib * 1024;
  }
  return std::nullopt;
}

namespace {

// Throws ConfigError naming what fits when a stage's predicted device memory exceeds the device's.
void check_device_memory(const LauncherConfig& config, const MemoryPlan& memory) {
  if (!memory.device_bytes) return;
  size_t at = 0;
  const int64_t peak = largest_total(memory.stages, &at);
  const int64_t limit = *memory.device_bytes - memory.reserved_bytes;
  if (peak <= limit) return;
  const scheduler::DeviceMemoryOptions& o = memory.device_options;
  std::ostringstream why;
  why << (config.run.device_memory_gib ? "run.device_memory_gib: " : "device memory: ")
      << stage_name(memory.stages[at], static_cast<int64_t>(at)) << " is predicted to need " << exact(peak) << " ("
      << terms(memory.stages[at]) << ") at data.seq_len " << o.seq_len << " with " << o.microbatch_rows
      << " row(s) a microbatch, more than the device's " << gib(limit)
      << (memory.reserved_bytes > 0 ? " (its memory less " + gib(memory.reserved_bytes) + " reserved for CUDA)" : "")
      << ". What fits:";
  const int64_t seq =
      scheduler::max_seq_len(memory.shape, o, memory.num_devices, limit, true, 1, memory.memory_budget_bytes);
  if (seq > 0) {
    why << " data.seq_len <= " << seq;
  } else {
    why << " no data.seq_len with this plan (weights and gradients alone: "
        << gib(memory.stages[at].weights + memory.stages[at].grads) << "); more devices (run.devices) split it";
  }
  if (o.microbatch_rows > 1) {
    scheduler::DeviceMemoryOptions one = o;
    one.microbatch_rows = 1;
    const auto stages = scheduler::stage_memory(memory.plan, memory.shape, one);
    why << "; or one row a microbatch (run.num_microbatch = train.batch_size = " << config.train.batch_size << ": peak "
        << gib(largest_total(stages)) << (fits(stages, limit) ? ", fits" : "") << ")";
  }
  if (!o.layer_recompute) {
    scheduler::DeviceMemoryOptions layer = o;
    layer.layer_recompute = true;
    const auto stages = scheduler::stage_memory(memory.plan, memory.shape, layer);
    why << "; or run.recompute: layer (peak " << gib(largest_total(stages)) << (fits(stages, limit) ? ", fits" : "")
        << ")";
  }
  why << " (docs/user-guide.md, \"Planning memory\")";
  throw ConfigError(why.str());
}

// Throws ConfigError naming the options that would fit when the predicted host peak exceeds
// MemAvailable.
void check_host_memory(const LauncherConfig& config, const MemoryPlan& memory) {
  const std::optional<int64_t> available = available_host_bytes();
  if (!available || memory.host.total() <= *available) return;
  std::ostringstream why;
  const scheduler::HostMemory& h = memory.host;
  why << "host memory: the run is predicted to peak at " << exact(h.total()) << " ("
      << per_param(h.total(), memory.params.total) << " x " << memory.params.total << " parameters: compute copies "
      << gib(h.compute_copies) << ", masters " << gib(h.masters) << ", gradients " << gib(h.grads)
      << ", optimizer state " << gib(h.optimizer_state) << ", CPU devices' stages " << gib(h.cpu_devices)
      << ", layer inputs kept for the recompute " << gib(h.saved_inputs) << "), more than the " << gib(*available)
      << " MemAvailable in /proc/meminfo.";
  std::string options;
  auto consider = [&](const std::string& name, LauncherConfig alternative) {
    MemoryPlan alt = plan_memory(alternative);
    const int64_t total = alt.host.total();
    options += "\n  " + name + ": " + gib(total) + (total <= *available ? " (fits)" : " (does not fit either)");
  };
  if (config.optimizer.state_dtype != OptimizerStateDtype::kInt8 &&
      (config.optimizer.name == OptimizerName::kAdam || config.optimizer.name == OptimizerName::kAdamW)) {
    LauncherConfig int8 = config;
    int8.optimizer.state_dtype = OptimizerStateDtype::kInt8;
    consider("optimizer.state_dtype: int8", int8);
  }
  if (!config.model.lora) {
    LauncherConfig lora = config;
    lora.model.lora.emplace();
    lora.model.lora->rank = 8;
    lora.model.lora->alpha = 16.0;
    lora.model.lora->dropout = 0.0;
    // all-linear is refused on mixtures of experts (check_lora_targets): attention only there.
    const bool moe = memory.shape.experts > 0;
    lora.model.lora->targets =
        moe ? std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj"} : std::vector<std::string>{"all-linear"};
    consider(std::string("model.lora: {rank: 8, targets: ") +
                 (moe ? "[q_proj, k_proj, v_proj, o_proj]" : "[all-linear]") + "} (fine-tunes model.pretrained)",
             lora);
  }
  if (config.run.step_mode == StepMode::kAsync) {
    LauncherConfig sync = config;
    sync.run.step_mode = StepMode::kSync;
    consider("run.step_mode: sync", sync);
  }
  const bool adam = config.optimizer.name == OptimizerName::kAdam || config.optimizer.name == OptimizerName::kAdamW;
  if (adam && config.model.master_dtype != c10::kBFloat16) {
    LauncherConfig bf16 = config;
    bf16.model.dtype = c10::kBFloat16;
    bf16.model.master_dtype = c10::kBFloat16;
    bf16.optimizer.kahan_sum = true;
    bf16.run.step_mode = StepMode::kSync;
    consider("model.dtype: bfloat16, model.master_dtype: bfloat16, optimizer.kahan_sum: true, run.step_mode: sync",
             bf16);
  }
  why << " Predicted with:" << options << "\n  (a smaller model or a machine with more memory also fits)";
  throw ConfigError(why.str());
}

}  // namespace

void check_memory_fits(const LauncherConfig& config) {
  const MemoryPlan memory = plan_memory(config);
  check_device_memory(config, memory);
  check_host_memory(config, memory);
}

}  // namespace roundpipe::launcher
