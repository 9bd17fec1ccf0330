// The launcher's use of the memory model (scheduler/memory_model.h): a config's device and host
// predictions, printed by `roundpipe plan` and checked by `roundpipe train` before any weight loads.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <ostream>
#include <vector>

#include "roundpipe/launcher/config.h"
#include "scheduler/memory_model.h"

namespace roundpipe::launcher {

/// The memory model's predictions for a config, from its model shape alone (no weights).
struct MemoryPlan {
  scheduler::TransformerShape shape;
  scheduler::DeviceMemoryOptions device_options;
  std::vector<c10::Device> devices;  ///< run.devices (RoundPipe's devices)
  int64_t num_devices = 1;
  int64_t num_microbatch = 1;  ///< the microbatches of a step (run.num_microbatch, at most batch_size)
  bool cpu_devices = true;
  /// The runtime's partition budget per stage (RoundPipeOptions::device_memory_budget_bytes):
  /// with CUDA devices half of device_bytes, else unlimited.
  int64_t memory_budget_bytes = std::numeric_limits<int64_t>::max();
  scheduler::ExecutePlan plan;                 ///< the runtime's (size-based) plan
  std::vector<scheduler::StageMemory> stages;  ///< its stages' peaks at data.seq_len
  std::optional<int64_t> device_bytes;         ///< run.device_memory_gib, else the smallest GPU's
  /// Of each device's memory, what stages cannot use: kCudaReservedBytes on CUDA devices, else 0.
  int64_t reserved_bytes = 0;
  scheduler::ParameterCount params;
  scheduler::HostMemory host;
};

/// Device memory a CUDA process cannot give to its stages: the CUDA context, cuBLAS/cuDNN
/// workspaces and the caching allocator's rounding and fragmentation. An allowance, to be
/// measured on a GPU (docs/benchmarks.md, "Memory model").
inline constexpr int64_t kCudaReservedBytes = int64_t{1} << 30;

/// The predictions for `config` (reads model.pretrained's config.json, nothing else: no weights,
/// no GPU) on `plan`, by default the plan the runtime builds (scheduler::runtime_plan within
/// memory_budget_bytes). Throws ConfigError for a model config the model cannot build.
MemoryPlan plan_memory(const LauncherConfig& config, const std::optional<scheduler::ExecutePlan>& plan = std::nullopt);

/// The `roundpipe plan` lines: per-stage peaks, the longest seq_len under the device memory (and
/// under 24 and 80 GiB when none is known), the host prediction.
void print_memory_plan(const LauncherConfig& config, const MemoryPlan& memory, std::ostream& out);

/// Bytes of MemAvailable in /proc/meminfo (nullopt when it cannot be read).
std::optional<int64_t> available_host_bytes();

/// `roundpipe train`'s refusal, before loading anything: throws ConfigError when a stage's
/// predicted device peak exceeds the device memory (naming the stage, its bytes and the seq_len,
/// microbatch or recompute settings that fit), or when the predicted host peak exceeds
/// MemAvailable (naming the numbers and the options that fit: LoRA, optimizer.state_dtype: int8).
void check_memory_fits(const LauncherConfig& config);

}  // namespace roundpipe::launcher
