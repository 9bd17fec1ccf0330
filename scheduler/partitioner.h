// The automatic partitioner: chooses an ExecutePlan from per-layer cost estimates and sizes.
// Pure CPU logic; the runtime feeds it size-based estimates first and measured times later.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "scheduler/execute_plan.h"

namespace roundpipe::scheduler {

/// Cost estimate of one layer. Times are in any consistent unit (bytes for size-based
/// estimates, milliseconds for measured ones).
struct LayerCost {
  double forward = 0;            ///< time of a forward stage's pass (the recompute in training)
  double backward = 0;           ///< time of a backward stage's pass: recompute + backward
  int64_t bytes = 0;             ///< parameters + buffers on the device (forward stages)
  int64_t backward_bytes = 0;    ///< bytes + gradients on the device (backward stages)
};

/// Size-based estimates used before any time was measured: forward = bytes, backward =
/// 3 x bytes (recompute ~1x + backward ~2x), so forward stages hold ~3x the layers of backward
/// stages. `grad_bytes[i]` are the gradient bytes of layer i's trainable parameters.
std::vector<LayerCost> size_based_costs(const std::vector<int64_t>& bytes,
                                        const std::vector<int64_t>& grad_bytes);

struct PartitionOptions {
  /// Stages fewer than this do not make the pipeline faster: cost = max(stages, min_stages) x
  /// stage time. Usually the number of devices.
  int64_t min_stages = 1;
  /// Bytes one stage may hold on a device (pass half the usable device memory when the next
  /// stage's upload is prefetched while one runs). Default: unlimited. The runtime passes
  /// RoundPipeOptions::device_memory_budget_bytes (default: half the smallest GPU's memory).
  int64_t memory_budget_bytes = std::numeric_limits<int64_t>::max();

  PartitionOptions& set_min_stages(int64_t v) { min_stages = v; return *this; }
  PartitionOptions& set_memory_budget_bytes(int64_t v) { memory_budget_bytes = v; return *this; }
};

/// Cost of `plan` under the partitioner's model: max(num_stages, min_stages) x the longest
/// stage time (forward stages sum `forward`, backward stages incl. the fused tail sum
/// `backward`). Infinity when a stage exceeds the memory budget.
double plan_cost(const ExecutePlan& plan, const std::vector<LayerCost>& costs,
                 const PartitionOptions& options);

/// The plan of minimum `plan_cost` for `type` (ties: the shortest stage time). Exact under the
/// cost model: every candidate stage time (each contiguous sum of forward or backward costs) is
/// considered, and for a fixed stage time the greedy tiling (longest fused tail, then greedy
/// forward and backward stages) uses the fewest stages. O(L^2 log L) time.
/// Throws c10::Error if a layer alone exceeds the memory budget (naming the layer and sizes),
/// or on invalid inputs (no layers, negative costs, min_stages < 1).
ExecutePlan partition(const std::vector<LayerCost>& costs, RunType type,
                      const PartitionOptions& options = {});

}  // namespace roundpipe::scheduler
