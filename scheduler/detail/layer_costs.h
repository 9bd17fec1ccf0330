// Validation of per-layer cost estimates shared by the partitioner and the planner (internal).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "scheduler/execute_plan.h"
#include "scheduler/partitioner.h"

namespace roundpipe::scheduler::detail {

/// Throws c10::Error naming the layer when a cost is not finite or negative (message prefixed with
/// `cost_prefix`), or when a layer alone needs more than `memory_budget_bytes` on a device for a
/// run of `type` (prefixed with `budget_prefix`).
void check_layer_costs(const std::vector<LayerCost>& costs, RunType type, int64_t memory_budget_bytes,
                       const std::string& cost_prefix, const std::string& budget_prefix);

}  // namespace roundpipe::scheduler::detail
