// The memory model's predictions for real model shapes (scheduler/memory_model.h), no GPU needed:
// the longest sequence that fits 24 and 80 GiB devices for Qwen3-1.7B and Llama-3.1-8B (bf16,
// one row a microbatch, CUDA: k/v not repeated, 1 GiB reserved for the CUDA context as
// `roundpipe plan` reserves), with the runtime's size-based plan and with stages cut by memory,
// and the host prediction per parameter of the configurations docs/benchmarks.md measured.
//
//   build/bench/memory_model_bench
#include <cstdio>

#include "scheduler/memory_model.h"

namespace sch = roundpipe::scheduler;

namespace {

constexpr int64_t kGiB = int64_t{1} << 30;
constexpr int64_t kCudaReserved = kGiB;  // roundpipe::launcher::kCudaReservedBytes

sch::TransformerShape qwen3_1_7b() {
  sch::TransformerShape s;
  s.vocab = 151936;
  s.hidden = 2048;
  s.intermediate = 6144;
  s.num_layers = 28;
  s.heads = 16;
  s.kv_heads = 8;
  s.head_dim = 128;
  s.qk_norm = true;
  s.tied_embeddings = true;
  return s;
}

sch::TransformerShape llama_3_1_8b() {
  sch::TransformerShape s;
  s.vocab = 128256;
  s.hidden = 4096;
  s.intermediate = 14336;
  s.num_layers = 32;
  s.heads = 32;
  s.kv_heads = 8;
  s.head_dim = 128;
  return s;
}

void print_max_seq(const char* name, const sch::TransformerShape& shape) {
  const sch::ParameterCount n = sch::count_parameters(shape);
  sch::DeviceMemoryOptions o;
  o.dtype_bytes = 2;
  o.microbatch_rows = 1;
  std::printf("%s: %.2fB parameters, %lld B saved per token per decoder layer (bf16)\n", name, n.total / 1e9,
              static_cast<long long>(sch::layer_memory(shape, o)[1].saved_per_token));
  std::printf(
      "  | GiB | devices | recompute | longest seq_len, runtime plan | longest seq_len, stages cut by memory |\n");
  for (int64_t gib : {24, 80}) {
    for (int64_t devices : {1, 8}) {
      for (bool layer : {false, true}) {
        o.layer_recompute = layer;
        const int64_t usable = gib * kGiB - kCudaReserved;
        // The runtime's plan on GPUs: stages within half the device's memory (RoundPipe's default
        // device_memory_budget_bytes).
        const int64_t budget = gib * kGiB / 2;
        std::printf("  | %lld | %lld | %s | %lld | %lld |\n", static_cast<long long>(gib),
                    static_cast<long long>(devices), layer ? "layer" : "stage",
                    static_cast<long long>(sch::max_seq_len(shape, o, devices, usable, true, 1024, budget)),
                    static_cast<long long>(sch::max_seq_len(shape, o, devices, usable, false)));
      }
    }
  }
  o.layer_recompute = false;
  o.seq_len = sch::max_seq_len(shape, o, 1, 24 * kGiB - kCudaReserved, false);
  sch::ExecutePlan plan;
  if (o.seq_len > 0 && sch::memory_aware_plan(shape, o, 1, 24 * kGiB - kCudaReserved, &plan)) {
    std::printf("  at %lld tokens under 24 GiB: %s\n", static_cast<long long>(o.seq_len), plan.to_string().c_str());
    const auto stages = sch::stage_memory(plan, shape, o);
    size_t largest = 0;
    for (size_t i = 0; i < stages.size(); ++i) {
      if (stages[i].total() > stages[largest].total()) largest = i;
    }
    for (size_t i : {size_t{0}, largest}) {  // the first forward stage and the largest
      const sch::StageMemory& m = stages[i];
      std::printf(
          "    stage %zu %s: %.2f GiB = weights %.2f + grads %.2f + saved %.2f + recompute %.2f + head %.2f + "
          "boundary %.2f\n",
          i, m.layers.to_string().c_str(), m.total() / double(kGiB), m.weights / double(kGiB), m.grads / double(kGiB),
          m.saved_activations / double(kGiB), m.recompute / double(kGiB), m.head / double(kGiB),
          m.boundary / double(kGiB));
    }
  }
}

// The 125M-parameter Llama of docs/benchmarks.md's host measurement (vocab 32000, hidden 768,
// 12 layers, intermediate 2048, 12 heads / 4 kv heads; seq_len 32, batch 2 in 2 microbatches,
// CPU devices).
void print_host() {
  sch::TransformerShape s;
  s.vocab = 32000;
  s.hidden = 768;
  s.intermediate = 2048;
  s.num_layers = 12;
  s.heads = 12;
  s.kv_heads = 4;
  s.head_dim = 64;
  const sch::ParameterCount n = sch::count_parameters(s);
  struct Case {
    const char* name;
    int64_t compute_bytes;
    bool async;
    sch::OptimizerStateKind state;
    int64_t devices;
  };
  const Case cases[] = {
      {"fp32, AdamW, sync, 1 CPU device", 4, false, sch::OptimizerStateKind::kAdamFloat32, 1},
      {"fp32, AdamW, async, 1 CPU device", 4, true, sch::OptimizerStateKind::kAdamFloat32, 1},
      {"bf16, AdamW, async, 1 CPU device", 2, true, sch::OptimizerStateKind::kAdamFloat32, 1},
      {"fp32, AdamW int8 states, sync, 1 CPU device", 4, false, sch::OptimizerStateKind::kAdamInt8, 1},
      {"fp32, AdamW, sync, 2 CPU devices", 4, false, sch::OptimizerStateKind::kAdamFloat32, 2}};
  std::printf("host prediction, %lld parameters:\n", static_cast<long long>(n.total));
  for (const Case& c : cases) {
    sch::DeviceMemoryOptions o;
    o.dtype_bytes = c.compute_bytes;
    o.seq_len = 32;
    o.microbatch_rows = 1;
    o.repeat_kv = true;
    sch::HostMemoryOptions h;
    h.compute_bytes = c.compute_bytes;
    h.master_bytes = 4;
    h.optimizer = c.state;
    h.async_step = c.async;
    h.cpu_device_bytes = sch::cpu_device_bytes(sch::runtime_plan(s, o, c.devices), s, o, c.devices);
    const sch::HostMemory m = sch::host_memory(n, h);
    std::printf("  %-46s %.1f B/param (live state %.1f, CPU devices %.1f)\n", c.name, double(m.total()) / n.total,
                double(m.total() - m.cpu_devices) / n.total, double(m.cpu_devices) / n.total);
  }
}

}  // namespace

int main() {
  print_max_seq("Qwen3-1.7B", qwen3_1_7b());
  print_max_seq("Llama-3.1-8B", llama_3_1_8b());
  print_host();
  return 0;
}
